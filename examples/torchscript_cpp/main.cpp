// Loads a TorchScript module saved from Python (whose forward calls headscope ops),
// runs it on inputs saved with torch.save([...]) and writes the output with
// torch::jit::pickle_save, readable by torch.load.
//
//   headscope_run_torchscript module.pt inputs.pt output.pt
//
// Linking headscope::headscope is all it takes for the ops to be registered.
#include <torch/script.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: " << argv[0] << " module.pt inputs.pt output.pt\n";
    return 2;
  }
  try {
    torch::jit::Module module = torch::jit::load(argv[1]);
    std::ifstream in(argv[2], std::ios::binary);
    const std::vector<char> bytes{std::istreambuf_iterator<char>(in), {}};
    const auto inputs = torch::jit::pickle_load(bytes).toList();
    std::vector<torch::jit::IValue> args(inputs.begin(), inputs.end());
    const at::Tensor out = module.forward(args).toTensor();
    const auto pickled = torch::jit::pickle_save(out);
    std::ofstream(argv[3], std::ios::binary).write(pickled.data(), pickled.size());
    std::cout << "output " << out.sizes() << " " << out.dtype() << " sum " << out.sum().item<double>()
              << "\n";
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
