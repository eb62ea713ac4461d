"""The parent-side sampler lives in the package (``lowmem_hf.measure``), shared with ``lowmem-hf load``."""

from lowmem_hf.measure import *  # noqa: F401,F403
from lowmem_hf.measure import PREFIX, boost_sampler_priority, read_proc_status, reset_peak_rss, run_child, run_children, spawn_child  # noqa: F401
