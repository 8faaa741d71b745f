"""The keys-file overlay (k8s/overlays/cpu-dev-keys), beyond what tests/test_k8s.py checks of every
overlay: the routers' --keys-file is a file of the Secret pdserve-keys, mounted whole (so that
Kubernetes updates it in place and the routers reload it), and that file is a keys file the
router accepts, whose placeholder digests admit nobody."""
from __future__ import annotations

from pdserve.router.keys import parse
from tests.test_k8s import K8S, flag_values, one, render, router_container


def test_the_routers_read_the_keys_file_from_its_secret():
    objs = render(K8S / "overlays" / "cpu-dev-keys")
    deploy, router = router_container(objs)
    path = flag_values(router["args"])["--keys-file"]
    mount = next(m for m in router["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    assert mount["readOnly"] and "subPath" not in mount  # a subPath mount is never updated: no reload
    volume = next(v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    secret = one(objs, "Secret", volume["secret"]["secretName"])
    keys = parse(secret["stringData"][path[len(mount["mountPath"]) + 1:]], "pdserve-keys")
    assert keys and all(set(d[7:]) == {"0"} or set(d[7:-1]) == {"0"} for d in keys)  # placeholders only
    assert {k.tenant for k in keys.values()} == {"team-a", "team-b"}
    assert "PDSERVE_API_KEY" in {e["name"] for e in router["env"]}  # the operator's admin key stays
