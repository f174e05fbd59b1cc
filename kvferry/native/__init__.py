"""Small C kernels for CPU engines, built with the system C compiler on first use.

``build.load_library`` compiles one ``csrc/*.c`` file into a cached shared object; each
kernel module wraps one library behind a typed Python class and returns None where it cannot
be built, so every caller keeps a portable torch / numpy path.
"""
