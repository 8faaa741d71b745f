"""What the pools ask of Ray, and the message when Ray has less: pure, without Ray."""
from pdserve.config import ClusterConfig, PoolConfig
from pdserve.deploy.placement import (RayResources, cluster_demands, local_ray_cpus, placement_shortfall,
                                      pool_demand)

TWO_CORES = RayResources({"CPU": 2.0, "memory": 1e10}, {"CPU": 2.0, "memory": 1e10}, [{"CPU": 2.0, "memory": 1e10}])


def test_a_tensor_parallel_worker_asks_for_every_rank_on_one_node():
    d = pool_demand("prefill", PoolConfig(replicas=2, num_cpus=0.5, resource="big"), ranks=3)
    assert (d.workers, d.ranks, d.per_worker) == (2, 3, {"CPU": 1.5, "big": 1.0})
    assert d.total() == {"CPU": 3.0, "big": 2.0}
    assert pool_demand("decode", PoolConfig(num_gpus=1), 2, workers=0).total() == {"CPU": 0.0, "GPU": 0.0}


def test_tp3_on_two_cores_says_what_it_needs_what_ray_has_and_the_flags():
    config = ClusterConfig(prefill=PoolConfig(tp=3))
    msg = placement_shortfall(cluster_demands(config), TWO_CORES)
    assert msg is not None
    assert msg.startswith("they need 4 CPU in all: 1 prefill worker(s) of 3 CPU each (3 tensor-parallel ranks "
                          "packed on one node); 1 decode worker(s) of 1 CPU each.")
    assert "Ray has 2 CPU (free: 2 CPU)" in msg and "memory" not in msg
    assert "No node has room for one prefill worker" in msg
    assert "--ray-cpus 4" in msg and "--prefill-tp" in msg
    # the CPUs per worker that would fit, every pool shrunk alike: 3 x 0.5 + 0.5 = 2
    assert "--prefill-cpus 0.5 --decode-cpus 0.5" in msg


def test_what_fits_is_silent():
    assert placement_shortfall(cluster_demands(ClusterConfig()), TWO_CORES) is None
    config = ClusterConfig(prefill=PoolConfig(tp=3, num_cpus=0.5), decode=PoolConfig(num_cpus=0.5))
    assert placement_shortfall(cluster_demands(config), TWO_CORES) is None
    assert placement_shortfall([pool_demand("prefill", PoolConfig(), 1, workers=0)], TWO_CORES) is None


def test_growing_counts_what_is_held_and_the_node_a_worker_must_fit_on():
    # two nodes of 2 free CPUs each: 4 free in all, but a worker of 3 ranks fits on neither
    has = RayResources({"CPU": 6.0}, {"CPU": 4.0}, [{"CPU": 3.0}, {"CPU": 3.0}])
    assert placement_shortfall([pool_demand("prefill", PoolConfig(), 3, workers=1)], has, local=False) is None
    has = RayResources({"CPU": 4.0}, {"CPU": 4.0}, [{"CPU": 2.0}, {"CPU": 2.0}])
    msg = placement_shortfall([pool_demand("prefill", PoolConfig(), 3, workers=1)], has, local=False)
    assert "No node has room for one prefill worker" in msg and "on 2 nodes, the largest 2 CPU" in msg
    assert "--ray-cpus" not in msg and "more nodes" in msg  # a joined cluster is not sized by a flag
    held = RayResources({"CPU": 4.0}, {"CPU": 1.0}, [{"CPU": 4.0}])  # 3 CPUs held by running workers
    msg = placement_shortfall([pool_demand("decode", PoolConfig(), 1, workers=2)], held)
    assert "Ray has 4 CPU (free: 1 CPU)" in msg and "--ray-cpus 5" in msg


def test_gpus_and_custom_resources_name_their_own_remedy():
    msg = placement_shortfall([pool_demand("decode", PoolConfig(num_gpus=1, resource="a100"), 1)], TWO_CORES)
    assert "--decode-gpus" in msg and "nodes that advertise a100" in msg and "--ray-cpus" not in msg


def test_the_local_ray_grows_for_one_rank_workers_only():
    assert local_ray_cpus(ClusterConfig(), cores=2) == 2
    assert local_ray_cpus(ClusterConfig(prefill=PoolConfig(replicas=3), decode=PoolConfig(replicas=2)), 2) == 5
    assert local_ray_cpus(ClusterConfig(ray_cpus=8), 2) == 8
    assert local_ray_cpus(ClusterConfig(prefill=PoolConfig(num_cpus=0.5), decode=PoolConfig(num_cpus=0.25)), 1) == 1
    assert local_ray_cpus(ClusterConfig(mode="aggregated", decode=PoolConfig(num_cpus=0.5, replicas=3)), 1) == 2
    # ranks stepping in lockstep are not oversubscribed unasked: the placement check says so instead
    assert local_ray_cpus(ClusterConfig(prefill=PoolConfig(tp=3)), 2) == 2
    assert local_ray_cpus(ClusterConfig(prefill=PoolConfig(tp=3), ray_cpus=4), 2) == 4
