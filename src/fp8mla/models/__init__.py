"""Model layers built on fp8mla's cache and attention: the MLA layer of DeepSeek-V2/V3 and Kimi-K2, the DSA
(sparse) layer of GLM-5 and DeepSeek-V3.2, and the attention block of DeepSeek-V4."""
from .config import CONFIG_NAMES, MLAConfig, YarnRope, load_config
from .deepseek import DeepseekMLA, DeepseekMLAModel, MLAStep, begin_step
from .dsa import DSAAttention, DSAModel, DSAStep, begin_dsa_step
from .dsa_config import DSA_CONFIG_NAMES, DSAConfig, load_dsa_config
from .deepseek_v4 import V4Attention, V4Model, V4Step, begin_v4_step
from .indexer import DSACache, LightningIndexer
from .v4_cache import V4Cache
from .v4_config import V4_CONFIG_NAMES, V4Config, load_v4_config

__all__ = ["CONFIG_NAMES", "MLAConfig", "YarnRope", "load_config", "DeepseekMLA", "DeepseekMLAModel", "MLAStep",
           "begin_step", "DSAAttention", "DSAModel", "DSAStep", "begin_dsa_step", "DSA_CONFIG_NAMES", "DSAConfig",
           "load_dsa_config", "DSACache", "LightningIndexer", "V4Attention", "V4Model", "V4Step", "begin_v4_step",
           "V4Cache", "V4_CONFIG_NAMES", "V4Config", "load_v4_config"]
