"""File formats shared by the profiler, the optimizer and the runtime (docs/formats.md).

Every format is a frozen dataclass with ``from_dict``/``to_dict``, loaded from YAML with
``yaml.safe_load``, strictly validated (unknown keys, wrong types, negative sizes are errors that
name the file, the field and the fix) and written atomically.
"""

from pipedream.formats.plan import Plan, Prediction, StagePlan, load_plan, save_plan
from pipedream.formats.profile import (
    ActionOverhead,
    LayerProfile,
    PassSpread,
    Profile,
    ProfileValue,
    TiedParameter,
    load_profile,
    save_profile,
)
from pipedream.formats.topology import Level, Topology, load_topology, save_topology

__all__ = [
    "ActionOverhead",
    "LayerProfile",
    "Level",
    "PassSpread",
    "Plan",
    "Prediction",
    "Profile",
    "ProfileValue",
    "StagePlan",
    "TiedParameter",
    "Topology",
    "load_plan",
    "load_profile",
    "load_topology",
    "save_plan",
    "save_profile",
    "save_topology",
]
