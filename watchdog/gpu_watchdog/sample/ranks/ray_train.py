"""A Ray Train worker's rank from Ray Train's own record of it (``<session>/logs/train/ray-train-sys-worker-<ID>.log``,
written once the worker set up its process group; sample.ray_node). A Ray Train worker always gets its rank here:
this source is never done with one while the record is missing."""

from __future__ import annotations

from dataclasses import replace

from gpu_watchdog.sample import ray_node
from gpu_watchdog.sample.ranks.member import Claim, Member


class RayTrainRecord:
    def rank(self, member: Member) -> Claim | None:
        ray = member.read_ray()
        if ray is None or ray.driver:
            return None
        if ray.train is None:
            ray = replace(ray, train=ray_node.train_rank(ray.logs_dir, ray.worker_id, member.pid))
            member.keep_ray(ray)
        return Claim(ray.train.world_rank, "Ray Train's record of its worker") if ray.train is not None else None

    def done(self, member: Member) -> bool:
        train_worker = member.ray is not None and ray_node.actor_class(member.command()) == ray_node.TRAIN_WORKER_CLASS
        return member.ray_final and not train_worker


__all__ = ["RayTrainRecord"]
