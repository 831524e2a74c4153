"""Tests of attnopt.functional (a package so that same-named test modules in sibling folders do not clash)."""
