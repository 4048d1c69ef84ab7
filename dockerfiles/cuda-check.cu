// The toolchain check of CUDA profiles built from NVIDIA's wheels: compiles and links for the profile's archs
// (SASS only, checked with cuobjdump), using the runtime, a device function, and the driver API through its stub.
#include <cstdio>
#include <cuda.h>
#include <cuda_runtime.h>

__global__ void axpy(float a, const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

int main() {
  int driver = 0;
  CUresult r = cuDriverGetVersion(&driver);  // links against libcuda (the stub here, the driver at run time)
  float *x = nullptr, *y = nullptr;
  cudaError_t e = cudaMalloc(&x, 1024 * sizeof(float));
  if (e == cudaSuccess && cudaMalloc(&y, 1024 * sizeof(float)) == cudaSuccess) {
    axpy<<<4, 256>>>(2.0f, x, y, 1024);
    e = cudaDeviceSynchronize();
  }
  std::printf("driver %d (%d), kernel: %s\n", driver, static_cast<int>(r), cudaGetErrorString(e));
  return 0;
}
