"""EntMTP's scheduler: choose the speculation tree per step from a bank calibrated for the task and hardware.

signals.py    online signals (entropy EMA, path value, accepted-length EMA), one host sync per step
policies.py   static, binary (hysteresis), ladder, cost and dynamic policies; the acceptance and latency models
traces.py     calibration traces: every position's rank vector from one teacher-forced pass of the heads
search.py     EntMTP's greedy tree growth, the acceptance frontier, exact own-tree simulation
replay.py     policies and the hindsight oracle replayed on traces with measured latencies
calibrate.py  the calibration pipeline (traces, search, latency, frontiers, tuning)
profiles.py   profile files: save/load atomically, checks against model, heads and hardware
plots.py      the frontier plot of a profile
command.py    `entmtp calibrate`
"""

from .policies import POLICIES, BinaryPolicy, CostPolicy, DynamicPolicy, LadderPolicy
from .profiles import Profile, ProfileError, load_profile, resolve_profile

__all__ = [
    "POLICIES",
    "BinaryPolicy",
    "CostPolicy",
    "DynamicPolicy",
    "LadderPolicy",
    "Profile",
    "ProfileError",
    "load_profile",
    "resolve_profile",
]
