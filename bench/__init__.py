"""gstrain's benchmark and study wing: run its scripts from the repository root as `python -m bench.<script>`.

Nothing in gstrain/ imports from here; see bench/README.md for how each study runs on a GPU machine.
"""
