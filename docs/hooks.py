"""MkDocs hooks for the attnopt site (registered in ``mkdocs.yml``).

* The API reference is generated, not hand-listed: every public module of ``src/attnopt``
  (no path component starting with ``_``) gets a ``::: module`` block on its subpackage's
  page, and the pages join the navigation. A module a later change adds appears by itself.
* The math renderer comes from an installed package, not a CDN: MathJax 3's self-contained
  ``es5/tex-svg.js`` (fonts inlined as SVG paths) from the ``django-static-mathjax`` wheel
  (the ``docs`` extra) is added to the site as ``javascripts/mathjax/tex-svg.js``.
* Search from ``file://``: Material's ``offline`` plugin inlines the index as a script and
  links a Web Worker shim from a CDN; every page is pointed at the vendored copy of that shim
  (``docs/javascripts/iframe-worker-shim.js``, MIT) instead.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "attnopt"
MATHJAX_DEST = "javascripts/mathjax/tex-svg.js"
#: the Web Worker shim Material's offline plugin links from a CDN, and our vendored copy of it
SHIM_CDN = "https://unpkg.com/iframe-worker/shim"
SHIM_LOCAL = "javascripts/iframe-worker-shim.js"


#: modules that are the package's machinery, not its API: the command line, the claims the
#: ``reproduce`` command checks, the report writer, and the bench suites / training tasks
#: (their packages' own pages, ``attnopt.bench`` and ``attnopt.experiments``, stay)
INTERNAL = ("attnopt.cli", "attnopt.cli_analyze", "attnopt.cli_train", "attnopt.claims", "attnopt.report",
            "attnopt.bench.", "attnopt.experiments.", "attnopt.analysis.analyze_report")


#: the mechanism families of ``attnopt.functional``: each a package whose ``__init__`` holds the public
#: ops (documented on the package, with its members); its other files are implementations, not API ...
FAMILIES = ("attnopt.functional.doubly_normalized", "attnopt.functional.generalized",
            "attnopt.functional.kernel", "attnopt.functional.ot", "attnopt.functional.regularized")
#: ... but for these, which are API of their own (the Fenchel-Young losses, the regularizers, the
#: linear mode of kernel attention; the sparse maps are members of the regularized package)
FAMILY_API = ("attnopt.functional.regularized.losses", "attnopt.functional.regularized.regularizers",
              "attnopt.functional.kernel.linear")


def _internal(mod: str) -> bool:
    if mod.rpartition(".")[0] in FAMILIES and mod not in FAMILY_API:
        return True
    return any(mod.startswith(p) if p.endswith(".") else mod == p or mod.startswith(p + ".")
               for p in INTERNAL)


def public_modules(package: Path = PACKAGE) -> list[str]:
    """Dotted names of the public modules and packages under ``package``, sorted (no path
    component starting with ``_``, nothing :data:`INTERNAL`)."""
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts) or _internal(".".join(parts)):
            continue
        out.append(".".join(parts))
    return sorted(set(out))


def api_pages(modules: list[str]) -> dict[str, str]:
    """``{page path: markdown}``: one page for the root and one per direct subpackage/module."""
    groups: dict[str, list[str]] = {}
    for mod in modules:
        parts = mod.split(".")
        key = ".".join(parts[:2])
        groups.setdefault(key, []).append(mod)
    pages = {}
    for key, mods in sorted(groups.items()):
        lines = [f"# `{key}`", ""]
        if key == "attnopt":
            lines += ["::: attnopt", "    options:", "      members: false", "      show_root_heading: false"]
            subs = sorted(k for k in groups if k != "attnopt")
            links = ", ".join(f"[`{s}`]({_page(s)[4:]})" for s in subs)
            lines += ["", "Subpackages and modules: " + links, ""]
        for mod in mods:
            is_pkg = (PACKAGE.parent / Path(*mod.split(".")) / "__init__.py").exists()
            lines.append(f"::: {mod}")
            # a package: its docstring only, its members are documented in their modules (a family
            # package holds its public ops itself)
            if is_pkg and mod not in FAMILIES:
                lines += ["    options:", "      members: false"]
            lines.append("")
        pages[_page(key)] = "\n".join(lines)
    return pages


def _page(key: str) -> str:
    return "api/" + key + ".md"


def mathjax_source() -> Path:
    spec = importlib.util.find_spec("mathjax")
    if spec is None or spec.origin is None:
        raise RuntimeError("MathJax is not installed: pip install -e '.[docs]' (django-static-mathjax)")
    path = Path(spec.origin).parent / "static" / "mathjax" / "es5" / "tex-svg.js"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: the installed `mathjax` package is not django-static-mathjax")
    return path


def on_config(config, **kwargs):  # noqa: ARG001 - the mkdocs hook signature
    pages = api_pages(public_modules())
    entries = [{k[4:-3]: k} for k in pages]
    nav = [e for e in config["nav"] if not (isinstance(e, dict) and "API reference" in e)]
    nav.insert(len(nav) - 1, {"API reference": entries})
    config["nav"] = nav
    config["_attnopt_api_pages"] = pages
    return config


def on_files(files: Files, config, **kwargs):  # noqa: ARG001 - the mkdocs hook signature
    for path, content in config["_attnopt_api_pages"].items():
        files.append(File.generated(config, path, content=content))
    files.append(File.generated(config, MATHJAX_DEST, abs_src_path=os.fspath(mathjax_source())))
    return files


def on_post_page(output: str, page, config, **kwargs) -> str:  # noqa: ARG001 - the mkdocs hook signature
    depth = page.file.dest_uri.count("/")
    return output.replace(f'src="{SHIM_CDN}"', f'src="{"../" * depth}{SHIM_LOCAL}"')
