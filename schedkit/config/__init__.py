"""Configuration: strict pydantic models and one YAML loader.

Every field has a type, a range, a default and a docstring. Unknown keys are errors,
and so is a value of the wrong type: no coercion (``'8'`` or ``8.0`` is not an int,
``'off'`` is not a bool; an int is a valid float). A key given twice in one mapping is an
error too. ``load_config(path)`` turns any of these into a :class:`ConfigError` that
names the key, the offending value, the file and the line.

One module per section (``model``, ``runner``, ``cache``, ``scheduler``, ``plugins``,
``structured``, ``workload``, ``compare``, ``cluster``, ``server``), the root
:class:`Config` in ``root``, the YAML line locator in ``locator`` and the loader in
``loader``; every public name is re-exported here.
"""

from schedkit.config.base import LocatedValueError, StrictModel
from schedkit.config.cache import MAX_NUM_BLOCKS, CacheConfig
from schedkit.config.cluster import ReplicasConfig, RouterConfig
from schedkit.config.compare import CompareConfig, ProfileConfig, profile_scheduler
from schedkit.config.flow import FlowControlConfig
from schedkit.config.loader import config_from_dict, format_validation_error, load_config
from schedkit.config.locator import ConfigOrigin, load_yaml
from schedkit.config.model import ModelConfig
from schedkit.config.paths import cache_dir
from schedkit.config.plugins import PluginConfig
from schedkit.config.root import Config
from schedkit.config.runner import (
    RUNNER_CONFIGS,
    FakeRunnerConfig,
    PagedRunnerConfig,
    PluginRunnerConfig,
    RunnerConfig,
    SimulatedRunnerConfig,
)
from schedkit.config.scheduler import SchedulerConfig
from schedkit.config.server import ServerConfig
from schedkit.config.structured import StructuredOutputsConfig
from schedkit.config.workload import (
    FairnessConfig,
    LengthConfig,
    PriorityClassConfig,
    SharedPrefixConfig,
    SLOConfig,
    SLOTargets,
    TenantConfig,
    TraceConfig,
    WorkloadConfig,
)

__all__ = [
    "MAX_NUM_BLOCKS", "RUNNER_CONFIGS", "CacheConfig", "CompareConfig", "Config",
    "ConfigOrigin", "FairnessConfig", "FakeRunnerConfig", "LengthConfig", "LocatedValueError",
    "ModelConfig", "PagedRunnerConfig", "PluginConfig", "PluginRunnerConfig",
    "PriorityClassConfig", "ProfileConfig", "ReplicasConfig", "RouterConfig", "RunnerConfig", "FlowControlConfig",
    "SLOConfig", "SLOTargets", "SchedulerConfig", "ServerConfig", "SharedPrefixConfig",
    "SimulatedRunnerConfig", "StrictModel", "StructuredOutputsConfig", "TenantConfig",
    "TraceConfig", "WorkloadConfig", "cache_dir", "config_from_dict",
    "format_validation_error", "load_config", "load_yaml", "profile_scheduler",
]
