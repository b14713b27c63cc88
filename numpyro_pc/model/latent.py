"""The flat unconstrained latent space ``z`` shared by guides, sites and families.

NumPyro's continuous autoguides flatten the unconstrained latent sites *in model trace
order* (``numpyro.infer.autoguide._ravel_dict``), whereas ``jax.flatten_util.ravel_pytree``
sorts dictionary keys. :class:`LatentSpace` fixes the trace order once, from the
model's prototype trace, so that the flat vector used here is exactly the one the
guides use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np
from numpyro.distributions.transforms import biject_to

from numpyro_pc.errors import UnsupportedModelError
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax
    from typing import Any

__all__ = ["LatentSpace"]


@dataclass(frozen=True)
class LatentSpace:
    """Ordered description of a model's global latent sites.

    :param tuple names: latent site names in model trace order.
    :param tuple shapes: constrained value shape of each site.
    :param tuple unconstrained_shapes: shape of each site in unconstrained space.
    :param tuple transforms: ``biject_to(support)`` of each site, read from the
        prototype trace (used only to move guide parameters of ``AutoDelta`` between
        spaces; evaluation of the model re-derives supports at run time).
    """

    names: tuple
    shapes: tuple
    unconstrained_shapes: tuple
    transforms: tuple = field(compare=False, hash=False, repr=False)
    discrete_names: tuple = ()
    discrete_shapes: tuple = ()

    @classmethod
    def from_trace(cls, trace, allow_discrete=False) -> LatentSpace:
        """Build the latent space from a NumPyro trace (in its insertion order).

        :param dict trace: a trace of the model, e.g. from ``handlers.trace(...).get_trace``.
        :param bool allow_discrete: keep discrete latent sites aside (``discrete_names``; they
            are not part of the flat vector ``z``) instead of refusing them — for posteriors
            with discrete factors (:mod:`numpyro_pc.families.discrete`).
        :raises UnsupportedModelError: for discrete latent sites (unless allowed) or when no
            latent exists.
        """
        names, shapes, ushapes, transforms, discrete, dshapes = [], [], [], [], [], []
        for name, site in trace.items():
            if site["type"] != "sample" or site["is_observed"]:
                continue
            if site["infer"].get("is_auxiliary"):
                continue
            support = site["fn"].support
            if support.is_discrete and allow_discrete:
                discrete.append(name)
                dshapes.append(tuple(jnp.shape(site["value"])))
                continue
            if support.is_discrete:
                raise UnsupportedModelError(
                    f"latent site {name!r} is discrete (support {support}); the dual form "
                    "needs continuous latent variables (enumerate or marginalise discrete ones). If "
                    f"{name!r} is an observation, its data was not passed: check that the keyword argument "
                    "carrying it (e.g. y=...) is given, so that the site has obs=."
                )
            shape = tuple(jnp.shape(site["value"]))
            transform = biject_to(support)
            names.append(name)
            shapes.append(shape)
            ushapes.append(tuple(transform.inverse_shape(shape)))
            transforms.append(transform)
        if not names and not discrete:
            raise UnsupportedModelError("the model has no latent sample site to place a posterior on.")
        return cls(tuple(names), tuple(shapes), tuple(ushapes), tuple(transforms), tuple(discrete), tuple(dshapes))

    def select(self, names) -> LatentSpace:
        """The space of the continuous sites ``names`` only, in this space's order (no discrete sites)."""
        keep = [i for i, n in enumerate(self.names) if n in set(names)]
        pick = lambda seq: tuple(seq[i] for i in keep)  # noqa: E731
        return LatentSpace(pick(self.names), pick(self.shapes), pick(self.unconstrained_shapes), pick(self.transforms))

    @property
    def sizes(self) -> tuple[Any, ...]:
        """Number of unconstrained coordinates of each site."""
        return tuple(math.prod(s) for s in self.unconstrained_shapes)

    @property
    def dim(self) -> int:
        """Total dimension ``d`` of the flat unconstrained vector."""
        return sum(self.sizes)

    @property
    def offsets(self) -> tuple[Any, ...]:
        """Start offset of each site inside the flat vector."""
        return tuple(int(o) for o in np.cumsum((0,) + self.sizes)[:-1])

    def unravel(self, z) -> dict[str, jax.Array]:
        """Split a flat vector (trailing axis ``d``) into a dict of unconstrained values.

        Leading batch axes of ``z`` are kept: ``z.shape == (..., d)`` gives values of
        shape ``(..., *unconstrained_shape)``.
        """
        batch = jnp.shape(z)[:-1]
        out = {}
        for name, ushape, start, size in zip(self.names, self.unconstrained_shapes, self.offsets, self.sizes):
            out[name] = jnp.reshape(z[..., start:start + size], batch + ushape)
        return out

    def ravel(self, values, batch_ndim=0) -> jax.Array:
        """Concatenate a dict of unconstrained values into the flat vector, in trace order."""
        parts = []
        for name, ushape in zip(self.names, self.unconstrained_shapes):
            if name not in values:
                raise KeyError(f"missing latent site {name!r}; expected sites {list(self.names)}")
            value = jnp.asarray(values[name])
            batch = value.shape[:batch_ndim]
            parts.append(jnp.reshape(value, batch + (-1,)))
        if not parts:  # only discrete latents: an empty flat vector
            return jnp.zeros((0,), jnp.result_type(float))
        return jnp.concatenate(parts, axis=-1)

    def unconstrain(self, constrained) -> jax.Array:
        """Map constrained site values to the flat unconstrained vector (static supports)."""
        return self.ravel({n: t.inv(jnp.asarray(constrained[n])) for n, t in zip(self.names, self.transforms)})

    def labels(self) -> list[Any]:
        """Human-readable label of each flat coordinate, e.g. ``"w[3]"``."""
        out = []
        for name, ushape in zip(self.names, self.unconstrained_shapes):
            if ushape == ():
                out.append(name)
            else:
                out.extend(f"{name}[{','.join(map(str, idx))}]" for idx in np.ndindex(*ushape))
        return out

    def signature(self) -> dict[str, Any]:
        """JSON-friendly description used to check that two objects share a model."""
        out = {"names": list(self.names), "unconstrained_shapes": [list(s) for s in self.unconstrained_shapes]}
        if self.discrete_names:  # only then, so files without discrete latents keep their manifest
            out["discrete_names"] = list(self.discrete_names)
            out["discrete_shapes"] = [list(s) for s in self.discrete_shapes]
        return out
