"""Starting and scaling pdserve's processes: one worker with its registry heartbeat
(`worker_host.py`), Ray pools of them (`launch.py`), the in-process cluster (`local.py`), the
router as a process (`router_server.py`), `pdserve up` (`up.py`; whether its pools fit in Ray:
`placement.py`; its signals in every phase: `interrupts.py`), `pdserve worker`
(`worker_cmd.py`), `pdserve scale`'s client (`scale.py`) and the autoscaler (`autoscaler.py`,
its loop in `autoscale_loop.py`)."""
