"""pytest plugin for the GPU suite's time-limited runs (scripts/gpu_suite_device.sh): keep shard $SHARD of $SHARDS
(every SHARDS-th item of the collected order, so each shard gets a mix of the grid's axes) and deselect the node ids
listed in the file $DONE_IDS (cases an earlier, time-capped run already passed). Load with
``-p pytest_shard`` and scripts/ on PYTHONPATH; without the variables it keeps everything."""
import os


def pytest_collection_modifyitems(config, items):
    done_file = os.environ.get("DONE_IDS", "")
    done = set(open(done_file).read().split()) if done_file else set()
    keep = [it for it in items if it.nodeid not in done]
    shard, shards = int(os.environ.get("SHARD", "0")), int(os.environ.get("SHARDS", "1"))
    if shards > 1:
        keep = keep[shard::shards]
    kept = set(id(it) for it in keep)
    dropped = [it for it in items if id(it) not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
