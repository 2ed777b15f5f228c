"""Whether Fair Cast matters to a run that has it off: a probe of the share of each step's update that
round-to-nearest into the served dtype drops (:mod:`.core`), its capability (:mod:`.component`)."""
