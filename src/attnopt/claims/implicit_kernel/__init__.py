"""Claims of implicit-kernel-attention (one submodule per topic, all under paper ``implicit_kernel``).

Submodules are imported automatically: ``identities`` (Prop. 1, Prop. 2), ``approximation``
(Prop. 3, Prop. 4), ``sparsity`` (Prop. 5, Fig. 4a–b), ``complexity`` (Table 1 and the
linear-time mode's crossover).
"""
import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
