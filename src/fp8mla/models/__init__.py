"""Model layers built on fp8mla's cache and attention: the MLA layer of DeepSeek-V2/V3 and Kimi-K2, and the DSA
(sparse) layer of GLM-5 and DeepSeek-V3.2."""
from .config import CONFIG_NAMES, MLAConfig, YarnRope, load_config
from .deepseek import DeepseekMLA, DeepseekMLAModel, MLAStep, begin_step
from .dsa import DSAAttention, DSAModel, DSAStep, begin_dsa_step
from .dsa_config import DSA_CONFIG_NAMES, DSAConfig, load_dsa_config
from .indexer import DSACache, LightningIndexer

__all__ = ["CONFIG_NAMES", "MLAConfig", "YarnRope", "load_config", "DeepseekMLA", "DeepseekMLAModel", "MLAStep",
           "begin_step", "DSAAttention", "DSAModel", "DSAStep", "begin_dsa_step", "DSA_CONFIG_NAMES", "DSAConfig",
           "load_dsa_config", "DSACache", "LightningIndexer"]
