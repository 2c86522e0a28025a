/*
 * pyacl-moe declarations for the CANN 8.x op header
 * aclnnop/aclnn_moe_init_routing_v2.h: the two phases of the forward op.
 * Needs acl_base.h, acl_rt.h and acl_meta.h first.
 */

aclnnStatus aclnnMoeInitRoutingV2GetWorkspaceSize(
    const aclTensor *x, const aclTensor *expertIdx, int64_t activeNumOptional,
    int64_t expertCapacityOptional, int64_t expertNumOptional, int64_t dropPadModeOptional,
    int64_t expertTokensCountOrCumsumFlagOptional, bool expertTokensBeforeCapacityFlagOptional,
    const aclTensor *expandedXOut, const aclTensor *expandedRowIdxOut,
    const aclTensor *expertTokensCountOrCumsumOutOptional,
    const aclTensor *expertTokensBeforeCapacityOutOptional, uint64_t *workspaceSize,
    aclOpExecutor **executor);

aclnnStatus aclnnMoeInitRoutingV2(void *workspace, uint64_t workspaceSize,
                                  aclOpExecutor *executor, aclrtStream stream);
