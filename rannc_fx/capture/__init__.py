"""1. Capture: an nn.Module as one flat fx.GraphModule (torch.fx or torch.export), checked
against the model; what capture cannot trace kept as eager pieces and opaque nodes."""
