// MathJax 3 for pymdownx.arithmatex (generic mode); the script itself is copied into the
// site from the installed `django-static-mathjax` wheel by docs/hooks.py (no CDN).
window.MathJax = {
  tex: {inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]], processEscapes: true, processEnvironments: true},
  options: {ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex"},
  svg: {fontCache: "global"},
};
if (typeof document$ !== "undefined") {  // Material instant navigation: typeset new pages
  document$.subscribe(() => { if (window.MathJax.typesetPromise) { MathJax.typesetPromise(); } });
}
