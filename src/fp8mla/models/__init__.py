"""Model layers built on fp8mla's cache and attention: the MLA layer of DeepSeek-V2/V3 and Kimi-K2."""
from .config import CONFIG_NAMES, MLAConfig, YarnRope, load_config
from .deepseek import DeepseekMLA, DeepseekMLAModel, MLAStep, begin_step

__all__ = ["CONFIG_NAMES", "MLAConfig", "YarnRope", "load_config", "DeepseekMLA", "DeepseekMLAModel", "MLAStep",
           "begin_step"]
