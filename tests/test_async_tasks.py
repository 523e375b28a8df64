"""cancel_and_wait ends a background loop whose cancellation asyncio.wait_for swallowed
(Python 3.11: the inner awaitable completes in the iteration the cancellation arrives)."""

from __future__ import annotations

import asyncio

from gateway.async_tasks import cancel_and_wait


async def test_a_loop_that_lost_its_cancellation_is_ended():
    loop = asyncio.get_running_loop()
    answers = [loop.create_future()]

    async def maintain():  # the shape of a store's maintenance loop: errors caught, carries on
        while True:
            try:
                await asyncio.wait_for(answers[-1], 1.0)
            except asyncio.CancelledError:
                raise
            except Exception:
                pass
            answers.append(loop.create_future())
            await asyncio.sleep(0.01)

    task = loop.create_task(maintain())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    answers[-1].set_result("pong")  # completes in the iteration the cancellation arrives
    assert await asyncio.wait_for(cancel_and_wait(task, timeout=2.0), 5.0)
    assert task.done()


async def test_a_task_that_will_not_end_is_reported_not_awaited_forever():
    released = asyncio.Event()

    async def stubborn():
        while not released.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass

    loop = asyncio.get_running_loop()
    task = loop.create_task(stubborn())
    await asyncio.sleep(0)
    started = loop.time()
    assert not await cancel_and_wait(task, timeout=0.2)
    assert loop.time() - started < 1.0
    released.set()  # let it end, so that the test leaves no task behind
    assert await cancel_and_wait(task, timeout=2.0)
