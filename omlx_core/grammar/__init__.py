"""Grammar-constrained decoding with xgrammar: compiled grammars per tokenizer, a
per-request constraint that masks one row of logits, and tool-call formats.

xgrammar is the optional ``grammar`` extra; it imports without torch thanks to
:mod:`omlx_core.grammar.torch_stub`, which :func:`import_xgrammar` installs first.
Importing this package does not import xgrammar.
"""
