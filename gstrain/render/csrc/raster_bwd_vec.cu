// Backward kernels, vector layout (sm_90 float2/float4 atomics); split from the other layout so the two compile in parallel.
#include "raster_bwd.cuh"

namespace gstrain {

#define GSTRAIN_INSTANTIATE_BWD(CH)                                                                \
    template cudaError_t launch_raster_bwd<CH, true>(                                             \
        const RasterArgs &, const float *, const int *, const float *, const float *,              \
        const GradPtrs &, bool, int, bool, cudaStream_t                                                  \
    );
GSTRAIN_FOR_EACH_CHANNELS(GSTRAIN_INSTANTIATE_BWD)
#undef GSTRAIN_INSTANTIATE_BWD

} // namespace gstrain
