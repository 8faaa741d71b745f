"""The mixture-of-experts overlay (k8s/overlays/cpu-moe-pp-ep), beyond what tests/test_k8s.py
checks of every overlay: the model is a path on the pdserve-models volume, which every process
that reads it mounts (the head checks its shape, each worker rank loads its layers and experts,
the routers its tokenizer), the decode pool is 2 stages of 2 expert-parallel ranks and the
prefill pool 2 such ranks, each rank's CPUs within its pod's."""
from __future__ import annotations

from tests.test_k8s import K8S, flag_values, head_command, one, pod_templates, render, router_container


def config_value(objs: list[dict], key: str) -> str:
    return one(objs, "ConfigMap", "pdserve-config")["data"][key]


def test_every_reader_of_the_model_mounts_the_volume_it_is_on():
    objs = render(K8S / "overlays" / "cpu-moe-pp-ep")
    model = config_value(objs, "PDSERVE_MODEL")
    claim = one(objs, "PersistentVolumeClaim", "pdserve-models")
    assert model.startswith("/models/") and "ReadOnlyMany" in claim["spec"]["accessModes"]
    readers = {where: tpl for where, tpl in pod_templates(objs) if where.startswith("RayCluster")}
    deploy, _ = router_container(objs)
    readers["router"] = deploy["spec"]["template"]
    assert set(readers) == {"RayCluster head", "RayCluster group prefill", "RayCluster group decode", "router"}
    for where, tpl in readers.items():
        mounts = {m["mountPath"]: m for m in tpl["spec"]["containers"][0].get("volumeMounts", [])}
        assert mounts.get("/models", {}).get("readOnly"), f"{where}: /models not mounted read-only"
        volume = next(v for v in tpl["spec"]["volumes"] if v["name"] == mounts["/models"]["name"])
        assert volume["persistentVolumeClaim"]["claimName"] == "pdserve-models", where
    assert flag_values(head_command(objs))["--model"] == "${PDSERVE_MODEL}"


def test_the_pools_are_expert_parallel_and_the_decode_pool_a_pipeline_of_them():
    objs = render(K8S / "overlays" / "cpu-moe-pp-ep")
    ranks = {role: int(config_value(objs, f"PDSERVE_{role.upper()}_EP")) * int(config_value(objs, f"PDSERVE_{role.upper()}_PP"))
             for role in ("prefill", "decode")}
    assert ranks == {"prefill": 2, "decode": 4}
    assert config_value(objs, "PDSERVE_DECODE_PP") == "2" and config_value(objs, "PDSERVE_PREFILL_TP") == "1"
    groups = {g["groupName"]: g for g in one(objs, "RayCluster")["spec"]["workerGroupSpecs"]}
    for role, n in ranks.items():
        cpus = float(config_value(objs, f"PDSERVE_{role.upper()}_CPUS")) * n
        assert cpus == float(groups[role]["rayStartParams"]["num-cpus"]), role  # the pod holds its worker's ranks
