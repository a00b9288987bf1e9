"""The ``mori`` namespace of the umbp compatibility package: only ``mori.umbp`` is provided."""
