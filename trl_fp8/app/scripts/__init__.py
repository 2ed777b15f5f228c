"""Training scripts launched by the ``trl-fp8`` CLI through ``accelerate launch``."""
