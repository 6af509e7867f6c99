"""Engine configuration: frozen dataclasses, validated once, with CLI flags generated from them.

``engine`` holds the sections and the flag machinery, ``kv_transfer`` the P/D role,
``speculative`` speculative decoding; everything is importable from here.
"""

from pdserve.config.engine import (
    CUDAGRAPH_MODES,
    DEFAULT_CAPTURE_SIZES,
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    add_dataclass_args,
    add_engine_args,
    engine_option_names,
    parse_json_arg,
)
from pdserve.config.kv_transfer import (
    CONNECTORS,
    KV_ROLES,
    LOAD_FAILURE_POLICIES,
    TRANSPORTS,
    KVTransferConfig,
)
from pdserve.config.speculative import SpeculativeConfig

__all__ = [
    "CONNECTORS",
    "CUDAGRAPH_MODES",
    "DEFAULT_CAPTURE_SIZES",
    "KV_ROLES",
    "LOAD_FAILURE_POLICIES",
    "TRANSPORTS",
    "CacheConfig",
    "CompilationConfig",
    "DeviceConfig",
    "EngineConfig",
    "KVTransferConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "add_dataclass_args",
    "add_engine_args",
    "engine_option_names",
    "parse_json_arg",
]
