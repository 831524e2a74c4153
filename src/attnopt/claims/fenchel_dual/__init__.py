"""Claims of fenchel-dual-attention (one submodule per topic, all under paper ``fenchel_dual``).

Submodules are imported automatically: ``mem`` (Thm 1, eq. 13/14, Sec. 5, Fig. 3),
``generalized`` (eq. 16, eq. 18), ``ot`` (Sec. 9 / App. D), ``pretrained`` (Sec. 8).
"""
import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
