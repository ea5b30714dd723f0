"""The runner's mesh around a call: the context mesh, traced batches, stray arrays."""

import contextlib

import jax
from jax.core import Tracer
from jax.sharding import Mesh
from jaxtyping import PyTree

from ._partition import path_str
from ._transfer import replicated
from ._typing import ArrayLeaf, Batch, PRNGKeyArray


def in_mesh(mesh: Mesh) -> contextlib.AbstractContextManager[object]:
    """`jax.set_mesh(mesh)` where another context mesh is set, else nothing.

    Meshes compare as JAX's abstract meshes (axis names and sizes).

    Raises:
        ValueError: inside a trace under another context mesh, which JAX does not
            let a trace change (`jax.set_mesh` is refused under `jax.jit`).
    """
    context = jax.sharding.get_abstract_mesh()
    if context is mesh.abstract_mesh or context.empty:
        return contextlib.nullcontext()
    try:
        return jax.set_mesh(mesh)  # (it sets the mesh here; leaving restores)
    except ValueError:  # "`set_mesh` can only be used outside of `jax.jit`."
        raise ValueError(
            f"`MethodRunner`: called inside a trace (`jax.jit`, `jax.eval_shape`, "
            f"...) under the context mesh {dict(context.shape)}, not the runner's "
            f"{dict(mesh.shape)}; a trace cannot change its mesh (`jax.set_mesh` is "
            "refused under `jax.jit`). Call the runner outside the traced function, "
            "or set the runner's mesh around it (`with jax.set_mesh(runner.mesh): "
            "...`)."
        ) from None


def check_traced_batch(mesh: Mesh, prng_key: PRNGKeyArray, batch: Batch) -> None:
    """Refuse a traced batch off an Explicit mesh when the trace knows no mesh.

    A traced function that closes over the runner and gets the batch as NumPy or
    single-device arrays cannot place its outputs, typed with the runner's
    Explicit mesh (JAX: "Length of device assignment 1 is not equal to the size of
    the mesh"). A runner passed in as an argument (its key is traced on the mesh),
    a context mesh, or a one-device mesh gives the trace its mesh.

    Raises:
        ValueError: naming the batch leaf and the three ways out.
    """
    if (
        mesh.size == 1
        or (
            isinstance(prng_key, Tracer)
            and not jax.typeof(prng_key).sharding.mesh.empty
        )
        or not jax.sharding.get_abstract_mesh().empty
    ):
        return
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if isinstance(x, Tracer) and jax.typeof(x).sharding.mesh.empty:
            raise ValueError(
                f"`MethodRunner`: a runner on a mesh with Explicit axes "
                f"({dict(mesh.shape)}) is called inside a traced function "
                f"(`jax.jit`, `jax.eval_shape`, `jax.grad`, ...) on the traced "
                f"batch leaf {path_str(path)!r}, which is not placed on its mesh "
                "(a NumPy or single-device array passed to the traced function), "
                "and no context mesh is set: the traced function's outputs "
                "cannot be placed on a mesh it does not know. Set the mesh "
                "around the traced call (`with jax.set_mesh(runner.mesh): "
                "...`), pass the runner in as an argument of the traced "
                "function, or pass a batch placed on the mesh."
            )


def replicate_off_mesh(tree: PyTree, mesh: Mesh, devices: set[object]) -> PyTree:
    """Replicate over `mesh` the arrays of `tree` committed to other devices.

    `devices` is `set(mesh.devices.flat)`.

    `jax.jit` refuses an argument committed to another device set (e.g. a
    `jax.device_put(x, jax.devices()[3])`); arrays on the mesh and NumPy arrays
    pass as they are.
    """

    def put(x: ArrayLeaf) -> ArrayLeaf:
        if (
            isinstance(x, jax.Array)
            and not isinstance(x, Tracer)
            and x.committed
            and x.sharding.device_set != devices
        ):
            return jax.device_put(x, replicated(mesh, x))
        return x

    return jax.tree.map(put, tree)
