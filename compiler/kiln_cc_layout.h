/*
 * kiln_cc_layout — which tensors the program keeps channels-last (internal
 * to the compiler).
 *
 * A mobile network's blocks (1×1 expansion, depthwise convolution, 1×1
 * projection, squeeze-and-excitation) run faster with the channels along
 * the vectors: a depthwise tap is then one multiply-add of sixteen
 * channels with no transposes, and a 1×1 convolution is a plain product
 * over rows of channels.  From -O2 on, this pass marks the 4-D tensors
 * between such ops channels-last ([N, H, W, C] in the program, every
 * other tensor keeping ONNX's [N, C, H, W]):
 *
 *   - a tensor is channels-last only when every op that reads it takes
 *     that layout: a depthwise Conv (one channel per group, channels-last
 *     in and out), a 1×1 ungrouped Conv (either layout out), a
 *     GlobalAveragePool, a Transpose to [N, H, W, C] (below), an Add,
 *     Sub, Mul or Div whose other operand is
 *     channels-last too or one value per channel (or a scalar); never a
 *     graph output;
 *   - it is written by a Conv that can write it (a depthwise one from
 *     channels-last, or an ungrouped one with packed weights that is not
 *     3×3 of stride 1, which may run by Winograd), or by such an Add, Sub,
 *     Mul or Div;
 *   - a Transpose by (0, 2, 3, 1) takes it, and one by (0, 3, 1, 2)
 *     writes it: convnext's permutes around its LayerNorm and Linear
 *     layers, which then move no byte (views: kiln_lower_shape.c);
 *   - a fused residual has its Conv's output's layout;
 *   - the channels-last tensors tied together by those ops are kept only
 *     where their group holds a depthwise convolution or a tensor that a
 *     Transpose to [N, H, W, C] reads (a copy saved): a network with
 *     neither (resnet, densenet) is left as it was.
 *
 * The layout changes no value: docs/engine.md.
 */
#ifndef KILN_CC_LAYOUT_H
#define KILN_CC_LAYOUT_H

#include "compiler/kiln_cc_lower.h"

/* Fill cx->cl (one flag per graph tensor) from cx->skip and cx->fusion. */
int kiln_cc_layout (kiln_cc_ctx_t *cx, kiln_err_t *err);

#endif
