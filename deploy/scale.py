"""`pdserve scale`'s client: asks a running `pdserve up` to resize its pools (POST
/admin/scale) and waits until new workers serve and removed ones have drained."""
from __future__ import annotations

import json
import urllib.error
import urllib.request


class ScaleError(RuntimeError):
    """The cluster refused the new sizes, or could not be reached."""


def request_scale(url: str, sizes: dict[str, int], api_key: str = "", timeout_s: float = 600.0) -> str:
    """The pools' sizes after resizing, as the JSON the endpoint answers."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    req = urllib.request.Request(url.rstrip("/") + "/admin/scale", json.dumps(sizes).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.dumps(json.loads(r.read())["pools"])
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise ScaleError(f"{e.code}: {detail}") from None
    except urllib.error.URLError as e:
        raise ScaleError(f"cannot reach {url}: {e.reason}") from None
