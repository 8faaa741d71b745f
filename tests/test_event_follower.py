"""The router's event follower with a real embedded redis-server: a worker id holding ":" is
read from where it left off, like any other."""
import asyncio

from pdserve.common.block_hash import hash_blocks
from pdserve.engine.core.block_manager import BlockManager
from pdserve.registry.embedded import EmbeddedRedis
from pdserve.registry.events import EventFollower, EventPublisher
from pdserve.router.prefix_index import PrefixIndex


def test_a_worker_id_with_colons_is_followed_from_where_it_left_off():
    async def main(url):
        import redis.asyncio as aioredis
        wid = "decode:zone-a:0"
        pub = EventPublisher(url, "colons", wid)
        await pub.reset_stream()
        bm = BlockManager(8, 4, listener=pub)
        prompt = list(range(20))
        bm.allocate("a", 20)
        bm.cache_full_blocks("a", prompt, 20)
        await pub.flush()
        client = aioredis.from_url(url)
        index = PrefixIndex()
        follower = EventFollower(client, "colons", index)
        first = await follower.poll([wid])
        again = [await follower.poll([wid]) for _ in range(3)]  # nothing new: nothing re-read
        held = index.match(hash_blocks(prompt + [1], 4))
        bm.free("a")
        await pub.stop()
        await client.aclose()
        return first, again, held

    with EmbeddedRedis() as r:
        first, again, held = asyncio.run(main(r.url))
    assert first == 5 and again == [0, 0, 0]
    assert held == {"decode:zone-a:0": 5}
