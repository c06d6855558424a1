"""Profiling: hooks on taps feeding streaming, mergeable statistics; the DIFF paper's Table 5 view."""

from diffquant.profile.profiler import Profile, Profiler, merge_profiles
from diffquant.profile.runner import profile_model
from diffquant.profile.stats import SiteStats
from diffquant.profile.tables import format_table5, layerwise, table5

__all__ = [
    "Profile",
    "Profiler",
    "SiteStats",
    "format_table5",
    "layerwise",
    "merge_profiles",
    "profile_model",
    "table5",
]
