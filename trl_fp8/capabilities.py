"""The capability list: what :class:`trl_fp8.GRPOTrainer` composes, in set-up order, and what
:class:`trl_fp8.GRPOConfig` takes its fields from. A new capability is a package plus one entry here.

Order matters where capabilities build on each other: MXFP8 and fast QLoRA change the policy's layers before Fair
Cast copies it into its served twin; DUET adjusts a batch's masks before the weight-sync checks compare logprobs on
it; the checks come after them, as they observe the sampler the others have set up; the time budget comes last (it only
observes steps and saves, and stops the run).
"""

from .budget.component import TimeBudget
from .duet.component import Duet
from .fair_cast.component import FairCast
from .mxfp8.component import MXFP8
from .qlora.component import FastQLoRA
from .sync.component import SyncChecks

CAPABILITIES = (MXFP8, FastQLoRA, FairCast, Duet, SyncChecks, TimeBudget)
