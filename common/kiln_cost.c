#include "common/kiln_cost.h"

#include <string.h>

/* The integer parameter `name` of `op`, or `dflt` when it is absent or
 * not an integer.  Reads without marking it used: the model looks, the
 * kernel decides. */
static int64_t
s_int (const kiln_prog_op_t *op, const char *name, int64_t dflt)
{
    for (int i = 0; i < op->n_params; i++)
        if (strcmp (op->params[i].name, name) == 0)
            return op->params[i].kind == KILN_PP_INT ? op->params[i].i : dflt;
    return dflt;
}

/* The product of the integer list `name` (1 when absent or empty). */
static double
s_ints_product (const kiln_prog_op_t *op, const char *name)
{
    double v = 1;
    for (int i = 0; i < op->n_params; i++)
        if (strcmp (op->params[i].name, name) == 0
            && op->params[i].kind == KILN_PP_INTS)
            for (int k = 0; k < op->params[i].n; k++)
                v *= (double) op->params[i].ints[k];
    return v;
}

/* Elements of a program tensor's shape (checked when the program was
 * decoded), as a double for the sums here. */
static double
s_numel (const kiln_shape_t *s)
{
    return (double) kiln_shape_count (s);
}

/* Multiply-adds of a convolution, from its input, output and the
 * `kernel` and `group` parameters: packed weights change W's shape, not
 * these. */
static double
s_conv_flops (const kiln_program_t *p, const kiln_prog_op_t *op)
{
    const kiln_shape_t *x = &p->tensors[op->inputs[0]].shape;
    const kiln_shape_t *y = &p->tensors[op->outputs[0]].shape;
    if (x->rank < 2 || y->rank < 2)
        return 0;
    int64_t group = s_int (op, "group", 1);
    if (group < 1)
        group = 1;
    /* a channels-last X ("layout" bit 0) is [N, H, W, C] */
    double c = (double) x->dims[(s_int (op, "layout", 0) & 1) && x->rank == 4 ? 3 : 1]
               / (double) group;
    return 2.0 * s_numel (y) * c * s_ints_product (op, "kernel");
}

kiln_cost_t
kiln_cost_op (const kiln_program_t *p, int i)
{
    const kiln_prog_op_t *op = &p->ops[i];
    kiln_cost_t c = { 0, 0 };
    for (int j = 0; j < op->n_inputs; j++)
        c.bytes += (double) p->tensors[op->inputs[j]].size;
    for (int j = 0; j < op->n_outputs; j++)
        c.bytes += (double) p->tensors[op->outputs[j]].size;
    switch (op->kernel) {
    case KILN_K_CONV2D:
    case KILN_K_CONV3D:
        c.flops = s_conv_flops (p, op);
        break;
    case KILN_K_CONV_TRANSPOSE2D:
    case KILN_K_CONV_TRANSPOSE3D: {
        /* each input element meets M/group · kernel weights */
        const kiln_shape_t *x = &p->tensors[op->inputs[0]].shape;
        const kiln_shape_t *y = &p->tensors[op->outputs[0]].shape;
        int64_t group = s_int (op, "group", 1);
        if (x->rank >= 2 && y->rank >= 2)
            c.flops = 2.0 * s_numel (x) * (double) y->dims[1] / (double) (group < 1 ? 1 : group)
                      * s_ints_product (op, "kernel");
        break;
    }
    case KILN_K_RNN: {
        /* every step's input and recurrent products: 2·T·B·(|W| + |R|) */
        const kiln_shape_t *x = &p->tensors[op->inputs[0]].shape;
        if (x->rank == 3 && x->dims[2] > 0 && op->n_inputs >= 3)
            c.flops = 2.0 * s_numel (x) / (double) x->dims[2]
                      * (s_numel (&p->tensors[op->inputs[1]].shape)
                         + s_numel (&p->tensors[op->inputs[2]].shape));
        break;
    }
    case KILN_K_MAXPOOL2D:
    case KILN_K_AVGPOOL2D:
    case KILN_K_POOL3D:
        /* a compare or an add per tap of every window */
        c.flops = s_numel (&p->tensors[op->outputs[0]].shape) * s_ints_product (op, "kernel");
        break;
    case KILN_K_TOPK: {
        /* a sort of each line: about 4·n·log2 n comparisons and moves */
        const kiln_shape_t *x = &p->tensors[op->inputs[0]].shape;
        int64_t axis = s_int (op, "axis", 0);
        double len = axis >= 0 && axis < x->rank ? (double) x->dims[axis] : 1;
        double lg = 1;
        for (double v = len; v > 1; v /= 2)
            lg++;
        c.flops = 4.0 * s_numel (x) * lg;
        break;
    }
    case KILN_K_MATMUL:
        c.flops = 2.0 * s_ints_product (op, "batch") * (double) s_int (op, "m", 0)
                  * (double) s_int (op, "n", 0) * (double) s_int (op, "k", 0);
        break;
    case KILN_K_GEMM:
        c.flops = 2.0 * (double) s_int (op, "m", 0) * (double) s_int (op, "n", 0)
                  * (double) s_int (op, "k", 0);
        break;
    case KILN_K_ATTENTION:
        /* its two products (the softmax between them is bytes in cache) */
        c.flops = 2.0 * s_ints_product (op, "batch") * (double) s_int (op, "m", 0)
                  * (double) s_int (op, "n", 0)
                  * (double) (s_int (op, "k", 0) + s_int (op, "nv", 0));
        break;
    default:
        break;
    }
    return c;
}

double
kiln_cost_ns (kiln_cost_t c)
{
    return c.flops / KILN_COST_FLOPS_PER_NS + c.bytes / KILN_COST_BYTES_PER_NS;
}
