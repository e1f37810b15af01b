"""One inference engine on one device."""
