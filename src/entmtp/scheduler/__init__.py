"""EntMTP's scheduler: choose the speculation tree per step from a bank calibrated for the task and hardware.

What runs during `generate` (the offline calibration that makes profiles is entmtp.calibration):

signals.py    online signals (entropy EMA, path value, accepted-length EMA), one host sync per step
policies.py   static, binary (hysteresis), ladder, cost and dynamic policies; the acceptance model
hybrid.py     a prompt-lookup branch sized per step over any tree policy
profiles.py   profile files: typed data (entmtp.codec's JSON), load, check against model, heads and hardware
factory.py    policies from a profile section on a machine's costs (`scheduled_policy`: what `build` runs)
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
