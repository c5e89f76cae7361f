"""Other projects' kernels timed beside ours (README.md): scripts run as `python -m bench.anchors.<name>`."""
