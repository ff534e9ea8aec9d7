// A CUDA step for benchmarks/gpu_container_check.py: the devices CUDA sees, then a kernel that
// adds two vectors of 16M floats on the GPU, checked on the host. Built with the CUDA runtime
// linked in statically, so the only CUDA library it loads is the driver's libcuda.so.1: the one
// the container gets from the node (node/gpus.py), or none.
#include <cstdio>
#include <cuda_runtime.h>

__global__ void fill(float* a, float* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { a[i] = float(i % 1000); b[i] = 2.0f * float(i % 1000); }
}

__global__ void add(const float* a, const float* b, float* c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}

static int fail(const char* what, cudaError_t e) {
  std::printf("%s: %s\n", what, cudaGetErrorString(e));
  return 1;
}

int main() {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return fail("cudaGetDeviceCount", e);
  cudaDeviceProp prop;
  if ((e = cudaGetDeviceProperties(&prop, 0)) != cudaSuccess) return fail("properties", e);
  std::printf("CUDA sees %d device(s); device 0: %s, %d SMs, %.0f MiB, bus %02x:%02x\n", count,
              prop.name, prop.multiProcessorCount, prop.totalGlobalMem / 1048576.0,
              prop.pciBusID, prop.pciDeviceID);
  const int n = 1 << 24;
  float *a, *b, *c;
  for (float** p : {&a, &b, &c})
    if ((e = cudaMalloc(p, n * sizeof(float))) != cudaSuccess) return fail("cudaMalloc", e);
  const int threads = 256, blocks = (n + threads - 1) / threads;
  fill<<<blocks, threads>>>(a, b, n);
  add<<<blocks, threads>>>(a, b, c, n);
  if ((e = cudaDeviceSynchronize()) != cudaSuccess) return fail("kernel", e);
  static float out[1 << 24];
  if ((e = cudaMemcpy(out, c, n * sizeof(float), cudaMemcpyDeviceToHost)) != cudaSuccess)
    return fail("cudaMemcpy", e);
  int wrong = 0;
  for (int i = 0; i < n; ++i) wrong += out[i] != 3.0f * float(i % 1000);
  std::printf("vector add of %d floats on the GPU: %s\n", n, wrong ? "WRONG" : "correct");
  return wrong ? 1 : 0;
}
