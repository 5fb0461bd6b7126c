"""The stage's transport under attack: oversized frames, malformed and forged messages,
unauthenticated TCP peers and killed clients, against real stage processes.

The attacker is a plain ZMQ socket in this process; a socket monitor tells when
the stage or the client has dropped it, so no check waits on time alone.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import msgspec
import pytest
import torch
import zmq
from conftest import wait_for
from test_stage import (  # nothing_left_behind: the stage tests' autouse leak check, here too
    Gate,
    Probe,
    nothing_left_behind,  # noqa: F401
    stage_config,
    until,
)
from zmq.utils import garbage
from zmq.utils.monitor import recv_monitor_message

from diffusion_runtime import InvalidFieldError, RequestStatus, RPCError, SamplingParams
from diffusion_runtime.stage import StageClient
from diffusion_runtime.stage.codec import tensor_from_frame
from diffusion_runtime.stage.endpoints import (
    SOCKET_DIR_PREFIX,
    bind,
    checked_host,
    reap_stale_socket_dirs,
)
from diffusion_runtime.stage.errors import StageProtocolError
from diffusion_runtime.stage.messages import (
    Error,
    FromStage,
    Ready,
    Result,
    Shutdown,
    StageDead,
    Status,
    StatusQuery,
    TensorMeta,
    decode_from_stage,
    encode,
)
from diffusion_runtime.stage.proc import StageSpec, run_stage
from diffusion_runtime.stage.security import CurveKeyPair

S = RequestStatus
FAST = SamplingParams(num_inference_steps=2, seed=3)
MiB = 1024 * 1024
FRAME_LIMIT = 1 * MiB
#: One image of the test pipeline is 3 x 16 x 16 float32 (3 KiB): 4 of them pass this.
REPLY_LIMIT = 16 * 1024
DROPPED = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


# -- the attacker ----------------------------------------------------------------------


class Attacker:
    """Plain ZMQ PUSH sockets aimed at the stage or the client, each with a monitor."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self._monitors: dict[zmq.Socket[Any], zmq.Socket[Any]] = {}

    def peer(self, endpoint: str, curve_server_key: bytes | None = None) -> zmq.Socket[Any]:
        """A socket connected to ``endpoint``; with ``curve_server_key``, a CURVE
        client with keys of its own (as one that learned the server's public key)."""
        socket = self.ctx.socket(zmq.PUSH)
        socket.linger = 0
        if curve_server_key is not None:
            own = CurveKeyPair.generate()
            socket.curve_publickey, socket.curve_secretkey = own.public, own.secret
            socket.curve_serverkey = curve_server_key
        self._monitors[socket] = socket.get_monitor_socket(DROPPED)
        socket.connect(endpoint)
        return socket

    def wait_dropped(self, socket: zmq.Socket[Any], timeout_s: float = 60.0) -> int:
        """Wait until the other side drops ``socket`` (or refuses its handshake); the event."""
        monitor = self._monitors[socket]
        assert monitor.poll(int(timeout_s * 1000)), "the peer was never dropped"
        event = recv_monitor_message(monitor)["event"]
        assert isinstance(event, int)
        return event

    def close(self) -> None:
        for socket, monitor in self._monitors.items():
            socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)
        self.ctx.term()
        garbage.gc.stop()  # pyzmq's thread that zero-copy sends start, idle once they end


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    attacker = Attacker()
    yield attacker
    attacker.close()


def vm_kib(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` memory figure (``VmRSS``, ``VmHWM``) in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def reset_peak_rss(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def reply_endpoint(client: StageClient) -> str:
    stage = client._stage
    assert stage is not None
    endpoint = stage.replies.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()


def request_endpoint(client: StageClient) -> str:
    assert client._stage is not None and client._stage.ready is not None
    return client._stage.ready.request_endpoint


# -- two stages, one per transport -----------------------------------------------------


@attrs.define
class Stages:
    loop: asyncio.AbstractEventLoop
    ipc: StageClient
    tcp: StageClient
    gate: Gate

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def serves(self, client: StageClient) -> None:
        """The client and its stage still serve: a health check and a request."""

        async def check() -> None:
            await client.check_health()
            [output] = await client.generate(["ok"], FAST)
            assert output.status is S.FINISHED_COMPLETED and output.image_batch is not None

        self.run(check())
        assert client.exitcode is None


@pytest.fixture(scope="module")
def stages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stages]:
    gate_dir = tmp_path_factory.mktemp("gate")
    config = stage_config(gate_dir, max_num_seqs=1, worker_extensions=(Probe,))
    loop = asyncio.new_event_loop()
    ipc = StageClient(config, max_frame_bytes=FRAME_LIMIT, max_reply_bytes=REPLY_LIMIT)
    tcp = StageClient(config, transport="tcp")
    try:
        loop.run_until_complete(ipc.start())
        loop.run_until_complete(tcp.start())
        yield Stages(loop, ipc, tcp, Gate(gate_dir))
    finally:
        loop.run_until_complete(ipc.shutdown())
        loop.run_until_complete(tcp.shutdown())
        loop.close()
    assert (ipc.exitcode, tcp.exitcode) == (0, 0)
    assert wait_for(lambda: not multiprocessing.active_children())


# -- frame limits ----------------------------------------------------------------------


def oversized_frames_drop_their_senders(
    stages: Stages, attacker: Attacker, peers: int, frame_bytes: int
) -> tuple[int, int]:
    """Send one ``frame_bytes`` frame from each of ``peers`` sockets at the stage;
    its idle RSS and its peak RSS meanwhile, in KiB."""
    pid = stages.ipc.pid
    assert pid is not None
    idle = vm_kib(pid, "VmRSS")
    reset_peak_rss(pid)
    frame = zmq.Frame(bytearray(frame_bytes))  # zero pages: cheap here, huge there
    sockets = [attacker.peer(request_endpoint(stages.ipc)) for _ in range(peers)]
    for socket in sockets:
        socket.send(frame, copy=False)
    for socket in sockets:
        assert attacker.wait_dropped(socket) == zmq.EVENT_DISCONNECTED
    return idle, vm_kib(pid, "VmHWM")


def test_an_oversized_request_frame_drops_its_sender_before_it_is_buffered(
    stages: Stages, attacker: Attacker
) -> None:
    idle, peak = oversized_frames_drop_their_senders(stages, attacker, 1, 64 * MiB)
    assert peak < 2 * idle and peak - idle < 32 * 1024, (idle, peak)
    stages.serves(stages.ipc)

    # The client refuses to send what the stage would drop it for.
    with pytest.raises(InvalidFieldError, match="max_frame_bytes") as refused:
        stages.run(stages.ipc.add_request("x" * FRAME_LIMIT, FAST))
    assert refused.value.field == "prompt"


@pytest.mark.slow
def test_twenty_peers_sending_a_gibibyte_each_leave_the_stage_rss_bounded(
    stages: Stages, attacker: Attacker
) -> None:
    idle, peak = oversized_frames_drop_their_senders(stages, attacker, 20, 1024 * MiB)
    print(f"stage RSS idle {idle} KiB, peak under 20 x 1 GiB frames {peak} KiB")
    assert peak < 2 * idle, (idle, peak)
    stages.serves(stages.ipc)


def test_the_client_drops_an_oversized_reply_frame_and_the_stage_never_sends_one(
    stages: Stages, attacker: Attacker
) -> None:
    forger = attacker.peer(reply_endpoint(stages.ipc))
    forger.send(bytearray(64 * MiB))
    assert attacker.wait_dropped(forger) == zmq.EVENT_DISCONNECTED
    stages.serves(stages.ipc)

    # Four images fit the client's limit; eight do not cross, and the output says why.
    async def outputs() -> list[Any]:
        counts = (4, 8)
        params = [attrs.evolve(FAST, num_outputs_per_prompt=n) for n in counts]
        return await stages.ipc.generate(["a", "b"], params)

    fits, too_big = stages.run(outputs())
    assert fits.status is S.FINISHED_COMPLETED and fits.image_batch.shape[0] == 4
    assert too_big.status is S.FINISHED_ERROR and too_big.image_batch is None
    assert "over the client's max_reply_bytes (16384)" in too_big.error

    # An RPC reply over the limit is refused by the stage instead of sent.
    assert stages.run(stages.ipc.collective_rpc("echo", ["x" * 1000])) == ["x" * 1000]
    with pytest.raises(RPCError, match="over the client's max_reply_bytes"):
        stages.run(stages.ipc.collective_rpc("echo", ["x" * REPLY_LIMIT]))
    stages.serves(stages.ipc)


# -- malformed replies -----------------------------------------------------------------


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def forged_result(request_id: str, image: TensorMeta | None) -> bytes:
    return encode(Result(request_id, S.FINISHED_COMPLETED, True, 1, None, None, 2, 2, image))


BAD_IMAGES: list[tuple[TensorMeta, list[bytes]]] = [
    (TensorMeta("float32", [2**64 - 1, 0]), [b""]),
    (TensorMeta("float32", [2**40, 2**40, 0]), [b""]),
    (TensorMeta("float32", [-1, 4]), [b"\0" * 16]),
    (TensorMeta("float32", [2, 2]), [b"\0" * 15]),
    (TensorMeta("complex128", [1]), [b"\0" * 16]),
    (TensorMeta("float32", [1]), []),
]


@pytest.mark.parametrize(("meta", "frames"), [case for case in BAD_IMAGES if case[1]])
def test_a_tensor_frame_that_cannot_hold_its_layout_is_a_protocol_error(
    meta: TensorMeta, frames: list[bytes]
) -> None:
    with pytest.raises(StageProtocolError):
        tensor_from_frame(meta, zmq.Frame(frames[0]))


def test_a_malformed_reply_fails_only_its_own_request_and_the_client_keeps_serving(
    stages: Stages, attacker: Attacker, caplog: pytest.LogCaptureFixture
) -> None:
    client = stages.ipc
    forger = attacker.peer(reply_endpoint(client))

    async def forge() -> list[BaseException]:
        ids = [f"forged-{i}" for i in range(len(BAD_IMAGES))]
        # The stage answers admissions between steps: the first request holds its
        # pipeline, the others wait to be admitted; each has its stream already.
        added = [
            asyncio.ensure_future(client.add_request(f"hold {i}", FAST, request_id=rid))
            for i, rid in enumerate(ids)
        ]
        await stages.gate.entered()
        for request_id, (meta, extra) in zip(ids, BAD_IMAGES, strict=True):
            forger.send_multipart([forged_result(request_id, meta), *extra])
        failures = []
        for request_id in ids:
            with pytest.raises(StageProtocolError) as failed:
                [_ async for _ in client.stream(request_id)]
            failures.append(failed.value)
        stages.gate.release()
        await asyncio.gather(*added)
        return failures

    unreadable = [
        b"\xc1",
        b"\x91" * 5000 + b"\x00",  # nested past any decoder
        b"\xdd\xff\xff\xff\xff",  # an array of 2**32 - 1 items, none sent
        msgspec.msgpack.encode({"type": "Result", "request_id": 5}),
        encode(StageDead("forged"))[:-1],
    ]
    with stages.gate, caplog.at_level(logging.ERROR, "diffusion_runtime.stage.client"):
        failures = stages.run(forge())
        for frame in unreadable:
            forger.send(frame)

        def dropped() -> int:
            return sum("dropped an unreadable message" in r.message for r in caplog.records)

        stages.run(until(lambda: dropped() == len(unreadable)))
    assert "2**63" in str(failures[0]) and "cannot be built" in str(failures[1])
    assert "needs 16 bytes" in str(failures[3]) and "complex128" in str(failures[4])
    assert "extra frames" in str(failures[5])
    stages.serves(client)


# -- decode failures at the stage ------------------------------------------------------


def test_every_readable_protocol_break_at_the_stage_gets_an_error_reply(tmp_path: Path) -> None:
    """A raw stage driven with hand-made frames: what names a request or call is
    answered, what cannot be read is dropped, and the stage keeps serving."""
    ctx = zmq.Context()
    replies = ctx.socket(zmq.PULL)
    requests = ctx.socket(zmq.PUSH)
    spec = StageSpec(
        stage_config(tmp_path),
        reply_endpoint=bind(replies, f"ipc://{tmp_path}/replies"),
        request_address=f"ipc://{tmp_path}/requests",
    )
    process = multiprocessing.get_context("spawn").Process(target=run_stage, args=(spec,))
    process.start()

    def reply() -> FromStage:
        assert replies.poll(60_000), "no reply from the stage"
        return decode_from_stage(replies.recv())

    params = msgspec.to_builtins(attrs.asdict(FAST))

    def add(**fields: Any) -> bytes:
        body = {"type": "AddRequest", "request_id": "r", "prompt": "p", "params": params, "seed": 3}
        return msgspec.msgpack.encode({**body, **fields})

    def add_prompt_last(raw_prompt: bytes) -> bytes:
        body = {
            "type": "AddRequest",
            "request_id": "r",
            "params": params,
            "seed": 3,
            "prompt": None,
        }
        return msgspec.msgpack.encode(body)[:-1] + raw_prompt

    answered: list[tuple[bytes, str]] = [
        (add(request_id="deep", prompt=nested(40)), "InvalidFieldError"),
        (add(request_id="ext", prompt=msgspec.msgpack.Ext(5, b"x")), "InvalidFieldError"),
        (add(request_id="type", params={**params, "extra_args": []}), "ProtocolError"),
        (
            msgspec.msgpack.encode({"type": "AddRequests", "request_id": "b", "prompts": "p"}),
            "ProtocolError",
        ),
        (
            msgspec.msgpack.encode({"type": "CollectiveRPC", "call_id": 7, "method": 1}),
            "ProtocolError",
        ),
        (
            msgspec.msgpack.encode({"type": "StatusQuery", "call_id": 8, "extra": None}),
            "ProtocolError",
        ),
    ]
    dropped = [
        msgspec.msgpack.encode({"type": "Abort", "request_ids": "r"}),  # names no id of its own
        msgspec.msgpack.encode({"type": "StatusQuery", "call_id": True}),
        add_prompt_last(b"\xdb\xff\xff\xff\xff"),  # a string of 4 GiB, never sent
        add_prompt_last(b"\x91" * 5000 + b"\x00"),  # nested past any decoder
    ]
    try:
        ready = reply()
        assert isinstance(ready, Ready)
        requests.connect(ready.request_endpoint)
        for frame in dropped:
            requests.send(frame)
        requests.send(encode(StatusQuery(1)))
        assert reply() == Status(1, True, None, 0)  # nothing answered the dropped ones
        for frame, kind in answered:
            requests.send(frame)
            error = reply()
            assert isinstance(error, Error) and error.kind == kind, error
            assert error.request_id is not None or error.call_id is not None
        requests.send(encode(Shutdown()))
        process.join(30)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        ctx.destroy(linger=0)


# -- authenticated TCP -----------------------------------------------------------------


def curve_server_keys(client: StageClient) -> tuple[bytes, bytes]:
    """The public keys the stage's and the client's receiving sockets serve with."""
    assert client._stage is not None and client._stage.identity is not None
    identity = client._stage.identity
    return identity.peer_public, identity.own.public


def test_unauthenticated_tcp_peers_are_refused_before_any_message(
    stages: Stages, attacker: Attacker
) -> None:
    """Peers without keys, and peers with keys of their own that know the server's
    public key, never get a forged Shutdown to the stage or StageDead to the client."""
    client = stages.tcp
    stage_key, client_key = curve_server_keys(client)
    forgeries = [
        (request_endpoint(client), None, encode(Shutdown())),
        (request_endpoint(client), stage_key, encode(Shutdown())),
        (reply_endpoint(client), None, encode(StageDead("forged"))),
        (reply_endpoint(client), client_key, encode(StageDead("forged"))),
    ]
    for endpoint, server_key, frame in forgeries:
        forger = attacker.peer(endpoint, server_key)
        forger.send(frame)
        refused = attacker.wait_dropped(forger)
        if server_key is not None:
            assert refused == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    stages.serves(client)


def test_binding_every_interface_needs_an_opt_in(caplog: pytest.LogCaptureFixture) -> None:
    for host in ("*", "0.0.0.0", "::"):
        with pytest.raises(InvalidFieldError, match="allow_all_interfaces=True") as refused:
            StageClient(stage_config(Path()), transport="tcp", host=host)
        assert refused.value.field == "host"
    with pytest.raises(InvalidFieldError, match="must be a str"):
        checked_host(7, allow_all_interfaces=True)
    with caplog.at_level(logging.WARNING, "diffusion_runtime.stage.endpoints"):
        StageClient(stage_config(Path()), transport="tcp", host="*", allow_all_interfaces=True)
    assert "binds every interface" in caplog.text


def test_frame_limits_are_refused_by_field_unless_positive_int64s() -> None:
    config = stage_config(Path())
    for field, value in [
        ("max_frame_bytes", 0),
        ("max_reply_bytes", 2**63),
        ("max_frame_bytes", True),
    ]:
        with pytest.raises(InvalidFieldError) as refused:
            StageClient(config, **{field: value})
        assert refused.value.field == field and "[1, 2**63)" in refused.value.rule


# -- the socket directory --------------------------------------------------------------

KILLED_CLIENT = """
import asyncio
from diffusion_runtime import EngineConfig
from diffusion_runtime.stage import StageClient

async def main() -> None:
    config = EngineConfig(pipeline="diffusion_runtime.testing.pipelines:NullPipeline")
    client = await StageClient(config).start()
    print(client.socket_dir, client.pid, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def is_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def test_a_killed_clients_socket_directory_is_removed_by_its_stage() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    client = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert client.stdout is not None
        socket_dir, stage_pid = client.stdout.readline().split()
        assert Path(socket_dir).stat().st_mode & 0o777 == 0o700
        assert Path(socket_dir).name.startswith(f"{SOCKET_DIR_PREFIX}{client.pid}-")
        client.send_signal(signal.SIGKILL)
        assert client.wait(30) == -signal.SIGKILL
        assert wait_for(lambda: is_gone(int(stage_pid)), 60), "the orphaned stage kept running"
        assert not Path(socket_dir).exists()
    finally:
        client.kill()
        client.wait()
        client.stdout.close()


def test_the_next_launch_reaps_directories_whose_owner_is_gone(tmp_path: Path) -> None:
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(finished.stdout)
    stale = tmp_path / f"{SOCKET_DIR_PREFIX}{dead_pid}-abc"
    live = tmp_path / f"{SOCKET_DIR_PREFIX}{os.getpid()}-abc"
    unnamed = tmp_path / f"{SOCKET_DIR_PREFIX}abc"  # not this scheme: left alone
    for path in (stale, live, unnamed):
        path.mkdir()
        (path / "requests").touch()
    assert reap_stale_socket_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and unnamed.exists()


def test_images_cross_unchanged_through_the_authenticated_transport(stages: Stages) -> None:
    async def both() -> tuple[Any, Any]:
        [over_tcp] = await stages.tcp.generate(["same"], FAST)
        [over_ipc] = await stages.ipc.generate(["same"], FAST)
        return over_tcp, over_ipc

    over_tcp, over_ipc = stages.run(both())
    assert torch.equal(over_tcp.image_batch, over_ipc.image_batch)
