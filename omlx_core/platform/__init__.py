"""The machine under omlx-core: which mlx backend and BLAS it has (:mod:`.backend`,
:mod:`.blas`) and the ``doctor`` report (:mod:`.doctor`).

Kept free of imports: the CLI imports :mod:`omlx_core.platform.blas` before mlx is
loaded, so nothing here may pull mlx in.
"""
