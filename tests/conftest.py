# Import the package first so its fast BLAS loads before mlx (see mlx_dflash/_blas.py).
import mlx_dflash  # noqa: F401
