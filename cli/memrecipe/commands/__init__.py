"""One click command per module; each module exposes `command`."""
