"""VGG-11 with batch norm for 32x32 images (CIFAR-style: eight 3x3 convolutions in five
max-pooled stages, then one linear classifier), trained with SGD and dropout-free.

    deepgen generate examples/vgg11.py -o build/vgg11

Parameters are named after PyTorch's state_dict keys of the same network written as an
nn.Sequential `features` (conv, bn, relu, ..., pool) and a `classifier` Linear.
"""

import generator as dg

N = dg.dim("N")
CONFIG = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


@dg.model
def vgg11(width=64):
    """`width`: the first convolution's channels, the others in proportion (the tests
    build the same network smaller: `vgg11.build(width=8)`)."""
    images = dg.input("images", (N, 3, 32, 32))
    labels = dg.input("labels", (N,), dtype="int64")
    x, index = images, 0
    for item in CONFIG:
        if item == "M":
            x = dg.max_pool2d(x, 2)
            index += 1
        else:
            x = dg.conv2d_layer(x, item * width // 64, 3, padding=1, name=f"features_{index}")
            x = dg.relu(dg.batch_norm_layer(x, name=f"features_{index + 1}"))
            index += 3
    features = 8 * width  # the last stage's channels, on a 1x1 map
    weight = dg.param("classifier_weight", (10, features), init=dg.uniform(-features**-0.5, features**-0.5))
    bias = dg.param("classifier_bias", (10,), init=dg.uniform(-features**-0.5, features**-0.5))
    logits = dg.flatten(x) @ weight.T + bias
    loss = dg.softmax_cross_entropy(logits, labels)
    dg.train(loss, dg.sgd(lr=0.05))
    return {"logits": logits}
