"""How an exponential-family product travels between processes: a run's ``family`` option as text, and a
product's description that a client sends and the server rebuilds (bounded: the text comes from a client)."""

from __future__ import annotations

import dataclasses
import json

from numpyro_pc.families.product import EF_FAMILIES, ProductFamily

from ..errors import ClientMessageError, InvalidOptionError

__all__ = ["parse_family", "is_ef_family", "family_json", "describe_family", "family_from_description"]


def parse_family(value) -> dict | str:
    """A run's ``family`` as given on a command line or in a config: a dict, its JSON text, ``"p=beta,r=gamma"``
    (an exponential-family product) or a Gaussian family's name (returned as it is)."""
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    text = str(value).strip()
    if text.startswith("{"):
        try:
            out = json.loads(text)
        except json.JSONDecodeError as err:
            raise InvalidOptionError(f"family {text!r} is neither a Gaussian family's name nor a JSON object "
                                     f"{{site: family name}} ({err})") from err
        if not isinstance(out, dict):
            raise InvalidOptionError(f"family {text!r}: expected a JSON object {{site: family name}}")
        return {str(k): str(v) for k, v in out.items()}
    if "=" in text:
        pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
        return {k.strip(): v.strip() for k, v in pairs}
    return text


def is_ef_family(value) -> bool:
    """Whether a run's ``family`` names an exponential-family product (a dict) rather than a Gaussian family."""
    return isinstance(parse_family(value), dict)


def family_json(family) -> str:
    """The canonical JSON text of a ``{site: family name}`` dict (the config the server sends)."""
    return json.dumps(dict(sorted(parse_family(family).items())))


def describe_family(family) -> str:
    """JSON text naming each factor of a :class:`~numpyro_pc.families.product.ProductFamily`: its ``family`` name and
    its fields (site, shape, number of categories); a Gaussian block's transform is left out — it maps values
    to the model's coordinates and plays no part in the natural parameters the server works with."""
    out = []
    for f in family.factors:
        fields = {fld.name: getattr(f, fld.name) for fld in dataclasses.fields(f) if fld.compare}
        out.append(dict(fields, family=type(f).family_name))
    return json.dumps(out, default=list)


_MAX_DESCRIPTION = 65536  # characters of a family description a client may send
_MAX_DIM = 2**20  # largest dimension of one factor's shape


def family_from_description(text) -> ProductFamily:
    """The :class:`~numpyro_pc.families.product.ProductFamily` of :func:`describe_family`'s text.

    :raises ClientMessageError: text that does not describe a product of known factors.
    """
    if not isinstance(text, str) or len(text) > _MAX_DESCRIPTION:
        raise ClientMessageError(f"expected a family description (a JSON text of at most {_MAX_DESCRIPTION} "
                                 f"characters), found {type(text).__name__} of length {len(text) if isinstance(text, str) else '-'}")
    try:
        factors = []
        for item in json.loads(text):
            item = dict(item)
            cls = EF_FAMILIES[item.pop("family")]
            item["shape"] = tuple(int(s) for s in item["shape"])
            if any(s < 0 or s > _MAX_DIM for s in item["shape"]):
                raise ValueError(f"shape {item['shape']} has a dimension outside [0, {_MAX_DIM}]")
            factors.append(cls(**item))
        return ProductFamily(tuple(factors))
    except Exception as err:  # an untrusted client's text: whatever it breaks, the client is refused, not the run
        raise ClientMessageError(f"expected a family description (a JSON list of factors named in "
                                 f"{sorted(EF_FAMILIES)}), found one that does not parse ({type(err).__name__}: "
                                 f"{err})") from err
