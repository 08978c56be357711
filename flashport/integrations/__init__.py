"""Adapters that plug flashport into other libraries.  Each submodule imports its library lazily, so
importing flashport never imports them."""
