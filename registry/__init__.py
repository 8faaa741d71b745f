"""The cluster's registry in Redis: who is in the cluster (`membership`), what each worker
has cached (`events`, the KV-event streams the routers' prefix indexes follow), Redis URLs
and connections without leaking their passwords (`urls`), and a private `redis-server` for
a cluster that brings none (`embedded`). Routers and workers import it; it imports only the
engine's event types."""
