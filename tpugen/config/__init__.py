"""The YAML run config: its schema, overrides, prompts, and every check made at the door."""

from tpugen.config.prompts import PromptSpec, run_sizes
from tpugen.config.resolve import ResolvedRun, config_hash, dump_config, load_config, resolve
from tpugen.config.schema import (
    CacheConfig,
    CompileConfig,
    ExecutionConfig,
    LoraConfig,
    MeshConfig,
    ModelConfig,
    OutputConfig,
    PodConfig,
    RayConfig,
    RunConfig,
    TorchTpuConfig,
    all_keys,
)
from tpugen.config.yamlio import dump_yaml, read_yaml, yaml_load

__all__ = [
    "CacheConfig",
    "CompileConfig",
    "ExecutionConfig",
    "LoraConfig",
    "MeshConfig",
    "ModelConfig",
    "OutputConfig",
    "PodConfig",
    "PromptSpec",
    "RayConfig",
    "ResolvedRun",
    "RunConfig",
    "TorchTpuConfig",
    "all_keys",
    "config_hash",
    "dump_config",
    "dump_yaml",
    "load_config",
    "read_yaml",
    "resolve",
    "run_sizes",
    "yaml_load",
]
