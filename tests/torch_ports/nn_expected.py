"""The expected failures of tests/torch_ports/test_nn_ports.py, each case named with its
reason (regenerated from a run whenever shoal gains what a case needs)."""

CASES, PASSING = 282, 245

BY_REASON = {
    'shoal lacks nn.Conv3d': (
        'test_Conv3d',
        'test_Conv3d_no_bias',
        'test_Conv3d_1x1x1_no_bias',
        'test_Conv3d_stride',
        'test_Conv3d_stride_padding',
        'test_Conv3d_zero_batch',
        'test_Conv3d_groups',
        'test_Conv3d_dilated',
        'test_Conv3d_dilated_strided',
        'test_Conv3d_pad_valid',
        'test_Conv3d_pad_same',
        'test_Conv3d_pad_same_dilated',
        'test_Conv3d_circular_stride2_pad2',
        'test_Conv3d_replicate_stride2_pad2',
        'test_Conv3d_zeros_stride2_pad2',
    ),
    "convolution padding_mode other than 'zeros' (reflect, replicate, circular) is not built": (
        'test_Conv1d_reflect_stride2_pad2',
        'test_Conv2d_reflect_stride2_pad2',
        'test_Conv1d_circular_stride2_pad2',
        'test_Conv2d_circular_stride2_pad2',
        'test_Conv1d_replicate_stride2_pad2',
        'test_Conv2d_replicate_stride2_pad2',
    ),
    'shoal lacks nn.ConvTranspose1d': (
        'test_ConvTranspose1d',
        'test_ConvTranspose1d_no_bias',
        'test_ConvTranspose1d_dilated',
        'test_ConvTranspose1d_groups',
    ),
    'shoal lacks nn.ConvTranspose2d': (
        'test_ConvTranspose2d',
        'test_ConvTranspose2d_dilated',
        'test_ConvTranspose2d_no_bias',
        'test_ConvTranspose2d_groups',
    ),
    "RReLU in training draws random slopes from shoal's generator, not torch's stream": (
        'test_RReLU',
        'test_RReLU_with_up_down',
        'test_RReLU_no_batch_dim',
    ),
    'shoal lacks nn.ConvTranspose3d': (
        'test_ConvTranspose3d',
        'test_ConvTranspose3d_dilated',
    ),
    "sparse gradients (sparse=True) are not supported: shoal's gradients are dense": (
        'test_EmbeddingBag_sparse',
        'test_Embedding_sparse',
    ),
    'shoal lacks nn.CrossMapLRN2d': (
        'test_CrossMapLRN2d',
    ),
}
EXPECTED_FAILURES = {name: reason for reason, names in BY_REASON.items() for name in names}
