"""headscope: attention introspection ops for PyTorch (``torch.ops.headscope.*``).

Importing the package loads the compiled library; the Python functions here add
argument conveniences on top of the ops, which are usable without them from
TorchScript, torch.compile/torch.export and C++.
"""
from ._library import load as _load

LIBRARY_PATH = _load()

from .mixer import FactorMixer, kl_hvp, kl_project, thin_mix  # noqa: E402
from .vas import (VAS_COLUMNS, VASAccumulator, vas_aggregate, vas_features,  # noqa: E402
                  vas_head_stats, vas_head_stats_qk)
from .detector import VASDetector  # noqa: E402
from .patterns import pattern_mask  # noqa: E402
from .attribution import (linear_attribution, pearson, region_pool, region_pool_qk,  # noqa: E402
                          region_pool_qk_layers, spearman, stack_layers, ward_regions)
from .head import AttributionHead  # noqa: E402
from .metrics import LDS, lds  # noqa: E402

__all__ = ["FactorMixer", "kl_hvp", "kl_project", "thin_mix", "LIBRARY_PATH",
           "AttributionHead", "LDS", "lds", "linear_attribution", "pearson", "region_pool",
           "region_pool_qk", "region_pool_qk_layers", "spearman", "stack_layers",
           "ward_regions", "pattern_mask",
           "VAS_COLUMNS", "VASAccumulator", "VASDetector", "vas_aggregate", "vas_features",
           "vas_head_stats", "vas_head_stats_qk", "explain"]


def __getattr__(name):
    # headscope.explain needs transformers, which `import headscope` never imports
    if name == "explain":
        from .explainer import explain
        return explain
    raise AttributeError(f"module 'headscope' has no attribute {name!r}")
