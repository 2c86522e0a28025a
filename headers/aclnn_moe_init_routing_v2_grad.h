/*
 * pyacl-moe declarations for the CANN 8.x op header
 * aclnnop/aclnn_moe_init_routing_v2_grad.h: the two phases of the op.
 * Needs acl_base.h, acl_rt.h and acl_meta.h first.
 */

aclnnStatus aclnnMoeInitRoutingV2GradGetWorkspaceSize(
    const aclTensor *gradExpandedX, const aclTensor *expandedRowIdx, int64_t topK,
    int64_t dropPadMode, int64_t activeNum, const aclTensor *out,
    uint64_t *workspaceSize, aclOpExecutor **executor);

aclnnStatus aclnnMoeInitRoutingV2Grad(void *workspace, uint64_t workspaceSize,
                                      aclOpExecutor *executor, aclrtStream stream);
