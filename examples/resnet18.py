"""ResNet-18 for 32x32 images (CIFAR-style: a 3x3 stem, four stages of two BasicBlocks
with batch norm, global average pooling, a linear classifier), trained with SGD.

    deepgen memory examples/resnet18.py --batch 64 --budget 2GiB   # static memory analysis
    deepgen generate examples/resnet18.py -o build/resnet18         # the C++ project

Parameter names are PyTorch's state_dict keys with dots as underscores (the common
CIFAR ResNet layout: conv1, bn1, layer1.0.conv1, ..., layer2.0.shortcut.0, linear),
in PyTorch's layouts, so a torch model's weights load one to one.
"""

import generator as dg

N = dg.dim("N")


def basic_block(x, channels, stride, name):
    """conv-bn-relu, conv-bn, plus the shortcut (a 1x1 conv and bn where the shape changes), relu."""
    out = dg.conv2d_layer(x, channels, 3, stride=stride, padding=1, bias=False, name=f"{name}_conv1")
    out = dg.relu(dg.batch_norm_layer(out, name=f"{name}_bn1"))
    out = dg.conv2d_layer(out, channels, 3, padding=1, bias=False, name=f"{name}_conv2")
    out = dg.batch_norm_layer(out, name=f"{name}_bn2")
    shortcut = x
    if stride != 1 or x.shape[1] != channels:
        shortcut = dg.conv2d_layer(x, channels, 1, stride=stride, bias=False, name=f"{name}_shortcut_0")
        shortcut = dg.batch_norm_layer(shortcut, name=f"{name}_shortcut_1")
    return dg.relu(out + shortcut)


@dg.model
def resnet18(image=32, width=64):
    """`image`: the images' height and width; `width`: the first stage's channels (the
    tests build the same network smaller: `resnet18.build(image=16, width=8)`)."""
    images = dg.input("images", (N, 3, image, image))
    labels = dg.input("labels", (N,), dtype="int64")
    x = dg.relu(dg.batch_norm_layer(dg.conv2d_layer(images, width, 3, padding=1, bias=False, name="conv1"), name="bn1"))
    for stage, (scale, stride) in enumerate([(1, 1), (2, 2), (4, 2), (8, 2)], start=1):
        x = basic_block(x, scale * width, stride, f"layer{stage}_0")
        x = basic_block(x, scale * width, 1, f"layer{stage}_1")
    pooled = dg.global_avg_pool(x)  # [N, 8 * width]
    features = 8 * width
    weight = dg.param("linear_weight", (10, features), init=dg.uniform(-features**-0.5, features**-0.5))
    bias = dg.param("linear_bias", (10,), init=dg.uniform(-features**-0.5, features**-0.5))
    logits = pooled @ weight.T + bias
    loss = dg.softmax_cross_entropy(logits, labels)
    dg.train(loss, dg.sgd(lr=0.05))
    return {"logits": logits}
