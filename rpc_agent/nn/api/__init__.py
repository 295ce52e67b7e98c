"""torch.distributed.nn.api's place in shoal: `remote_module`."""
